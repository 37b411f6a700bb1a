"""Shared helpers for the BEIR benchmarks: corpus loading, the on-disk embedding cache, metrics.

Embedding is the slow part of every benchmark on a CPU, so every vector goes through
``llama_index_retrieval_kit.indices.embed_texts`` with one SQLite cache under
``benchmarks/.cache/`` (git-ignored), keyed by (model, sha256 of the text). A vector is
computed once per text and reused by every later run, by every system that embeds the same
text (LlamaIndex's VectorStoreIndex and ours get identical vectors), and by the tuning script.

    python benchmarks/_common.py warm --dataset ../shared/datasets/beir/scifact

fills the cache for one corpus (queries of every split, whole documents as LlamaIndex's
default SentenceSplitter cuts them, and our SectionWindowNodeParser chunks); run it under
``nice`` in the background, it takes minutes per corpus on two CPU cores.
"""

from __future__ import annotations

import argparse
import gzip
import json
import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# numpy's OpenBLAS threads (used by Qdrant local mode's cosine search) spin after each call and
# take the CPU from torch's OpenMP threads: on 2 cores that doubled the query embedding time
# (about 22 -> 50 ms). One BLAS thread for numpy; torch keeps its own threads. Override by
# exporting OPENBLAS_NUM_THREADS before running.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

CACHE_DIR = REPO / "benchmarks" / ".cache"
CACHE_FILE = CACHE_DIR / "embeddings.sqlite"
DEFAULT_BEIR = REPO.parent / "shared" / "datasets" / "beir"

logger = logging.getLogger("benchmarks")


# ------------------------------------------------------------------------------------------ data
@dataclass
class BeirData:
    name: str
    corpus: Dict[str, Dict[str, str]]  # doc id -> {"title", "text"}, corpus order
    queries: Dict[str, str]  # query id -> text (only judged queries of the split)
    qrels: Dict[str, Dict[str, int]]
    split: str


def _read_jsonl_gz(path: Path) -> Iterable[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as fh:
        for line in fh:
            if line.strip():
                yield json.loads(line)


def read_corpus(folder: Path) -> Dict[str, Dict[str, str]]:
    return {str(r["_id"]): {"title": r.get("title") or "", "text": r["text"]} for r in _read_jsonl_gz(folder / "corpus.jsonl.gz")}


def read_qrels(path: Path) -> Dict[str, Dict[str, int]]:
    qrels: Dict[str, Dict[str, int]] = {}
    with open(path, encoding="utf-8") as fh:
        for i, line in enumerate(fh):
            parts = line.rstrip("\r\n").split("\t")
            if len(parts) != 3:
                continue
            try:
                score = int(parts[2])
            except ValueError:
                if i == 0:
                    continue
                raise
            qrels.setdefault(parts[0], {})[parts[1]] = score
    return qrels


def load_split(folder: Path, split: str, corpus: Optional[Dict[str, Dict[str, str]]] = None) -> BeirData:
    """One split of a BEIR folder as laid out in ../shared/datasets/beir (see its README)."""
    folder = Path(folder)
    qrels = read_qrels(folder / f"qrels_{split}.tsv")
    qfile = folder / f"queries_{split}.jsonl.gz"
    if not qfile.exists():
        qfile = folder / "queries.jsonl.gz"
    texts = {str(r["_id"]): r["text"] for r in _read_jsonl_gz(qfile)}
    missing = [q for q in qrels if q not in texts]
    if missing:
        raise ValueError(f"{folder}/{split}: {len(missing)} judged queries have no text, e.g. {missing[:3]}")
    queries = {q: texts[q] for q in qrels}
    return BeirData(folder.name, corpus if corpus is not None else read_corpus(folder), queries, qrels, split)


def tuning_splits(folder: Path) -> List[str]:
    """The non-test splits available for choosing parameters (dev first when present)."""
    found = [s for s in ("dev", "train") if (Path(folder) / f"qrels_{s}.tsv").exists()]
    return found


def doc_text(doc: Mapping[str, str]) -> str:
    """What a document is in every benchmark: title + blank line + text."""
    return f"{doc['title']}\n\n{doc['text']}" if doc.get("title") else doc["text"]


def our_documents(corpus: Mapping[str, Mapping[str, str]], ids: Optional[Sequence[str]] = None) -> list:
    """Documents for our HybridIndex: id = doc id, metadata doc_id (bookkeeping, not embedded)."""
    from llama_index.core import Document

    ids = list(corpus) if ids is None else ids
    return [Document(text=doc_text(corpus[i]), id_=i, metadata={"doc_id": i}) for i in ids]


def llama_documents(corpus: Mapping[str, Mapping[str, str]], ids: Optional[Sequence[str]] = None) -> list:
    """Documents for LlamaIndex's own pipeline: same text, id = doc id, no metadata."""
    from llama_index.core import Document

    ids = list(corpus) if ids is None else ids
    return [Document(text=doc_text(corpus[i]), id_=i) for i in ids]


# ------------------------------------------------------------------------------------------ parsers
DEFAULT_CHUNK_SIZE = 200
DEFAULT_CHUNK_OVERLAP = 40


def our_parser(chunk_size: int = DEFAULT_CHUNK_SIZE, chunk_overlap: int = DEFAULT_CHUNK_OVERLAP):
    from llama_index_retrieval_kit.node_parser import SectionWindowNodeParser

    return SectionWindowNodeParser(chunk_size=chunk_size, chunk_overlap=chunk_overlap)


def llama_parser():
    """LlamaIndex's default transformation for VectorStoreIndex.from_documents."""
    from llama_index.core.node_parser import SentenceSplitter

    return SentenceSplitter()


def embed_text_of(node) -> str:
    from llama_index.core.schema import MetadataMode

    return node.get_content(metadata_mode=MetadataMode.EMBED)


def node_doc_id(node) -> str:
    return node.metadata.get("doc_id") or node.ref_doc_id


# ------------------------------------------------------------------------------------------ embeddings
_MODEL = None


def embed_model():
    global _MODEL
    if _MODEL is None:
        from llama_index_retrieval_kit.models import default_embed_model

        _MODEL = default_embed_model()
    return _MODEL


_LI_MODEL = None


def llamaindex_embed_model():
    """LlamaIndex's own ``HuggingFaceEmbedding`` on the packaged MiniLM, with its defaults
    (PyTorch queries, ``embed_batch_size=10``): what a LlamaIndex user gets, for the baselines."""
    global _LI_MODEL
    if _LI_MODEL is None:
        from llama_index.embeddings.huggingface import HuggingFaceEmbedding

        from llama_index_retrieval_kit.models import DEFAULT_EMBED_MODEL, resolve_model_path

        _LI_MODEL = HuggingFaceEmbedding(model_name=resolve_model_path(DEFAULT_EMBED_MODEL))
    return _LI_MODEL


def open_cache():
    from llama_index_retrieval_kit.indices import EmbeddingCache

    return EmbeddingCache(CACHE_FILE)


def cached_embeddings(texts: Sequence[str], cache=None, batch_size: int = 256, show_progress: bool = False) -> np.ndarray:
    """Vectors of ``texts`` (rows in order), computed once and kept in the benchmark cache."""
    from llama_index_retrieval_kit.indices import embed_texts

    own = cache is None
    cache = cache or open_cache()
    try:
        return embed_texts(embed_model(), list(texts), cache, batch_size=batch_size, show_progress=show_progress)
    finally:
        if own:
            cache.close()


def cache_has(texts: Sequence[str]) -> int:
    """How many of ``texts`` already have a cached vector (no model load)."""
    from llama_index_retrieval_kit.indices.embedding_cache import text_key

    cache = open_cache()
    try:
        models = [r[0] for r in cache._conn.execute("SELECT DISTINCT model FROM vectors").fetchall()]
        keys = list({text_key(t) for t in texts})
        return max((len(cache.get_many(m, keys)) for m in models), default=0)
    finally:
        cache.close()


# ------------------------------------------------------------------------------------------ metrics
def evaluate(run: Mapping[str, Sequence[Tuple[str, float]]], qrels: Mapping[str, Mapping[str, int]]) -> Dict[str, float]:
    """nDCG@10, Recall@100, MRR@10 (trec_eval definitions; the package's evaluate_run)."""
    from llama_index_retrieval_kit.evaluation import evaluate_run

    res = evaluate_run(
        {q: [d for d, _ in r] for q, r in run.items()},
        {q: j for q, j in qrels.items() if q in run},
        metrics=("ndcg", "recall", "mrr"),
        ks=(10, 100),
        no_relevant="zero",
    )
    m = res.mean
    return {"ndcg@10": m["ndcg@10"], "recall@100": m["recall@100"], "mrr@10": m["mrr@10"]}


def docs_from_chunks(scored: Iterable[Tuple[str, float]], limit: int = 100) -> List[Tuple[str, float]]:
    """(doc id, score) best first from (doc id, score) chunk hits best first: max-score aggregation.

    The input is in the retriever's rank order; a document keeps its best chunk's score, and the
    list is re-sorted by that score (stable, so the retriever's order breaks ties).
    """
    best: Dict[str, float] = {}
    for doc, score in scored:
        s = float(score) if score is not None else 0.0
        if doc not in best or s > best[doc]:
            best[doc] = s
    ranked = sorted(best.items(), key=lambda kv: -kv[1])
    return ranked[:limit]


# ------------------------------------------------------------------------------------------ warm cache
def warm(folder: Path, chunkings: Sequence[Tuple[int, int]], whole_docs: bool = True) -> None:
    folder = Path(folder)
    corpus = read_corpus(folder)
    cache = open_cache()
    t0 = time.perf_counter()
    # 1. queries of every split (short: seconds)
    qtexts: List[str] = []
    for split in ("test", *tuning_splits(folder)):
        qtexts += list(load_split(folder, split, corpus).queries.values())
    cached_embeddings(qtexts, cache)
    print(f"[{folder.name}] {len(qtexts)} queries embedded ({time.perf_counter() - t0:.0f}s)", flush=True)
    # 2. whole documents as LlamaIndex's SentenceSplitter cuts them (LlamaIndex dense baseline)
    if whole_docs:
        nodes = llama_parser().get_nodes_from_documents(llama_documents(corpus))
        cached_embeddings([embed_text_of(n) for n in nodes], cache, show_progress=True)
        print(f"[{folder.name}] {len(nodes)} SentenceSplitter nodes embedded ({time.perf_counter() - t0:.0f}s)", flush=True)
    # 3. our chunks
    for size, overlap in chunkings:
        nodes = our_parser(size, overlap).get_nodes_from_documents(our_documents(corpus))
        cached_embeddings([embed_text_of(n) for n in nodes], cache, show_progress=True)
        print(f"[{folder.name}] {len(nodes)} chunks ({size}/{overlap}) embedded ({time.perf_counter() - t0:.0f}s)", flush=True)
    cache.close()


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description="fill the benchmark embedding cache")
    ap.add_argument("command", choices=["warm"])
    ap.add_argument("--dataset", type=Path, action="append", required=True)
    ap.add_argument("--chunking", action="append", default=None, help="SIZE/OVERLAP, repeatable (default 200/40)")
    ap.add_argument("--no-whole-docs", action="store_true")
    args = ap.parse_args(argv)
    chunkings = [tuple(int(x) for x in c.split("/")) for c in (args.chunking or [f"{DEFAULT_CHUNK_SIZE}/{DEFAULT_CHUNK_OVERLAP}"])]
    for folder in args.dataset:
        warm(folder, chunkings, whole_docs=not args.no_whole_docs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
