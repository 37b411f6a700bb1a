"""Scale of a whole ``HybridIndex`` on Qdrant Edge (issue 11's 100k / 1M bars).

    nice -n 10 python benchmarks/scale_index.py --sizes 100000 [--json PATH]
    nice -n 10 python benchmarks/scale_index.py --sizes 1000000 --json PATH   # where the limits are

Data: ``benchmarks/scale.py``'s synthetic chunks (60-120 Zipf words, about 600 characters,
metadata ``doc_id``, ``source`` of 20 values, ``page``), each a one-chunk ``Document``, and
random unit vectors (384-d) from a lookup-table embedding (:class:`TableEmbedding`: the vector
of a text is read from a precomputed matrix, so "embedding" costs a dict lookup and a copy).
The index uses its defaults otherwise (``SectionWindowNodeParser``, BM25 tokenizer, Edge).

Every size runs in two fresh child processes:

* build: ``HybridIndex.from_documents`` (defaults: no HNSW) timed whole, with the time spent
  inside the embedding model and inside the node parser measured and subtracted, giving the
  index-write throughput (BM25 index, docstore, embedding cache, Edge points, commit) the issue's
  bar names; then the optional HNSW build (``HybridIndex.optimize()``), timed on its own;
* reopen: ``HybridIndex.load`` time, RSS after reopen, then query p50/p95 (wall and CPU) of
  ``hybrid`` and ``qdrant_hybrid``, unfiltered and with ``source == source-3`` (5 % of the
  chunks), query embeddings given; plus reopen + first query.

Latencies are wall-clock and CPU time per query; measure on an idle machine. The parent samples
each child's RSS every 50 ms and kills it past ``--mem-limit-gib``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402
import psutil  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import scale  # noqa: E402  (the synthetic corpus and measuring helpers)

from llama_index.core.bridge.pydantic import PrivateAttr  # noqa: E402
from llama_index.core.embeddings import BaseEmbedding  # noqa: E402

DIM = scale.DENSE_DIM
RESULT_TAG = "SCALE-INDEX-RESULT "


class TableEmbedding(BaseEmbedding):
    """Random unit vectors looked up by text (precomputed), timing every call it answers."""

    _table: Dict[str, np.ndarray] = PrivateAttr(default_factory=dict)
    _seconds: float = PrivateAttr(default=0.0)

    @classmethod
    def class_name(cls) -> str:
        return "TableEmbedding"

    def set_table(self, texts: Sequence[str], vectors: np.ndarray) -> None:
        self._table = {t: v for t, v in zip(texts, vectors)}

    @property
    def seconds(self) -> float:
        return self._seconds

    def _vector(self, text: str) -> List[float]:
        vec = self._table.get(text)
        if vec is None:  # a chunk the parser cut differently: a deterministic vector of its hash
            rng = np.random.default_rng(abs(hash(text)) % (2**32))
            vec = rng.standard_normal(DIM).astype(np.float32)
            vec /= np.linalg.norm(vec)
        return vec.tolist()

    def _get_text_embeddings(self, texts: List[str]) -> List[List[float]]:
        t = time.perf_counter()
        out = [self._vector(x) for x in texts]
        self._seconds += time.perf_counter() - t
        return out

    def _get_text_embedding(self, text: str) -> List[float]:
        return self._get_text_embeddings([text])[0]

    def _get_query_embedding(self, query: str) -> List[float]:
        return self._get_text_embeddings([query])[0]

    async def _aget_query_embedding(self, query: str) -> List[float]:
        return self._get_query_embedding(query)


def documents(n: int) -> list:
    from llama_index.core import Document

    texts = scale.chunk_texts(n)
    return [
        Document(id_=f"doc-{i}", text=t, metadata={"doc_id": f"doc-{i}", "source": f"source-{i % 20}", "page": i % 50})
        for i, t in enumerate(texts)
    ]


def emit(result: Dict[str, Any]) -> None:
    result["process_peak_rss"] = scale.peak_rss_kernel()
    print(RESULT_TAG + json.dumps(result), flush=True)


def worker_build(n: int, workdir: Path) -> None:
    from llama_index_retrieval_kit.indices import HybridIndex
    from llama_index_retrieval_kit.node_parser import SectionWindowNodeParser

    docs = documents(n)
    parser = SectionWindowNodeParser()
    t, c = time.perf_counter(), time.process_time()
    nodes = parser.get_nodes_from_documents(docs)
    chunking, chunking_cpu = time.perf_counter() - t, time.process_time() - c
    model = TableEmbedding(embed_batch_size=1024)
    model.set_table([x.get_content() for x in nodes], scale.unit_vectors(len(nodes)))
    del nodes
    t, c = time.perf_counter(), time.process_time()
    HybridIndex.from_documents(docs, workdir / "index", node_parser=parser, embed_model=model).close()
    total, cpu = time.perf_counter() - t, time.process_time() - c
    folder = scale.dir_size(workdir / "index")
    with HybridIndex.load(workdir / "index", embed_model=model) as index:
        chunks = len(index)
        # The optional HNSW build (not part of from_documents' default), timed on its own; the
        # reopen worker then measures the engine-side modes with it.
        t, c = time.perf_counter(), time.process_time()
        index.optimize()
        hnsw, hnsw_cpu = time.perf_counter() - t, time.process_time() - c
    writes = total - model.seconds - chunking
    write_cpu = cpu - chunking_cpu - model.seconds  # CPU seconds (all threads): a busy neighbour core stretches wall time, not these
    emit({
        "kind": "build", "n": n, "chunks": chunks, "seconds": total, "cpu_seconds": cpu,
        "embedding_seconds": model.seconds, "chunking_seconds": chunking, "write_seconds": writes,
        "write_chunks_per_s": chunks / writes, "chunks_per_s_incl_chunking": chunks / (total - model.seconds),
        "chunking_cpu_seconds": chunking_cpu, "write_cpu_seconds": write_cpu,
        "write_chunks_per_cpu_s": chunks / max(1e-9, write_cpu),
        "hnsw_seconds": hnsw, "hnsw_cpu_seconds": hnsw_cpu,
        "folder_bytes": folder, "folder_bytes_with_hnsw": scale.dir_size(workdir / "index"),
    })


def worker_open(n: int, workdir: Path) -> None:
    from llama_index.core.schema import QueryBundle

    from llama_index_retrieval_kit.indices import HybridIndex

    model = TableEmbedding()
    rng = np.random.default_rng(7)
    vectors = rng.standard_normal((scale.QUERY_COUNT, DIM)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    bundles = [QueryBundle(q, embedding=v.tolist()) for q, v in zip(scale.queries(), vectors)]
    rss0 = scale.rss()
    t = time.perf_counter()
    index = HybridIndex.load(workdir / "index", embed_model=model)
    reopen = time.perf_counter() - t
    index.as_retriever("hybrid", similarity_top_k=scale.TOP_K).retrieve(bundles[0])
    first = time.perf_counter() - t
    result: Dict[str, Any] = {"kind": "open", "n": n, "reopen_seconds": reopen, "reopen_first_query_seconds": first,
                              "rss_after_reopen": scale.rss(), "rss_before": rss0}
    flt = scale.bm25_filter()
    with index:
        for mode in ("hybrid", "qdrant_hybrid", "sparse", "dense"):
            for name, filters in (("unfiltered", None), ("filtered", flt)):
                retriever = index.as_retriever(mode, similarity_top_k=scale.TOP_K, filters=filters)
                result[f"{mode}_{name}"] = scale.latency(retriever.retrieve, bundles)
    result["rss_after_queries"] = scale.rss()
    emit(result)


def worker_store(n: int, workdir: Path) -> None:
    """The point store alone (what scale.py measured for Qdrant local mode): HybridIndex's point
    layout (payload as LlamaIndex's QdrantVectorStore writes it, BM25 sparse vector, dense
    vector) written into a Qdrant Edge shard through ``EdgePoints``; BM25 tokens are computed
    first (the index computes them once for BM25 and the sparse vector)."""
    from llama_index.core.vector_stores.utils import node_to_metadata_dict

    from llama_index_retrieval_kit.indices.store import EdgePoints, point_id
    from llama_index_retrieval_kit.retrievers import BM25Retriever
    from llama_index_retrieval_kit.retrievers.qdrant_hybrid import bm25_doc_vector

    nodes = scale.make_nodes(scale.chunk_texts(n))
    tokenizer = BM25Retriever([])
    tokens = [tokenizer.node_tokens(x) for x in nodes]
    avgdl = sum(len(t) for t in tokens) / len(tokens)
    vectors = scale.unit_vectors(n)
    store = EdgePoints(workdir / "edge")
    store.create(DIM)
    t, c = time.perf_counter(), time.process_time()
    batch = 4096
    for start in range(0, n, batch):
        part = nodes[start : start + batch]
        store.upsert_points(
            [point_id(x.node_id) for x in part],
            vectors[start : start + batch],
            [bm25_doc_vector(tok, avgdl, 1.2, 0.75) for tok in tokens[start : start + batch]],
            [node_to_metadata_dict(x, remove_text=False, flat_metadata=False) for x in part],
        )
    store.flush()
    write, write_cpu = time.perf_counter() - t, time.process_time() - c
    t = time.perf_counter()
    store.optimize()
    optimize = time.perf_counter() - t
    store.close()
    t = time.perf_counter()
    store = EdgePoints(workdir / "edge")
    reopen = time.perf_counter() - t
    rng = np.random.default_rng(7)
    qv = rng.standard_normal((scale.QUERY_COUNT, DIM)).astype(np.float32)
    qv /= np.linalg.norm(qv, axis=1, keepdims=True)
    qtok = [tokenizer.tokenize(q) if hasattr(tokenizer, "tokenize") else q.split() for q in scale.queries()]
    sparse = [bm25_doc_vector(tok, avgdl, 1.2, 0.75) for tok in qtok]
    allowed = [x.node_id for x in nodes if x.metadata["source"] == "source-3"]
    excluded = [x.node_id for x in nodes if x.metadata["source"] != "source-3"]
    ids = store.ids_filter(allowed, excluded)
    items = list(zip(qv, sparse))
    result: Dict[str, Any] = {
        "kind": "store", "n": n, "write_seconds": write, "write_cpu_seconds": write_cpu, "write_points_per_s": n / write,
        "optimize_seconds": optimize, "reopen_seconds": reopen, "rss_after_reopen": scale.rss(),
        "folder_bytes": scale.dir_size(workdir / "edge"),
        "rrf": scale.latency(lambda it: store.search(it[0], it[1], limit=10), items),
        "rrf_ids_filter": scale.latency(lambda it: store.search(it[0], it[1], limit=10, filter=ids), items),
        "dense": scale.latency(lambda it: store.search(it[0], None, limit=10), items),
    }
    store.close()
    emit(result)


def run_child(kind: str, n: int, workdir: Path, mem_limit: float, timeout: float) -> Dict[str, Any]:
    cmd = [sys.executable, __file__, "--worker", kind, "--n", str(n), "--workdir", str(workdir)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak, started, killed = 0, time.time(), None
    ps = psutil.Process(proc.pid)
    while proc.poll() is None:
        try:
            now = ps.memory_info().rss
        except psutil.NoSuchProcess:
            break
        peak = max(peak, now)
        if now > mem_limit:
            killed = f"RSS passed {mem_limit / scale.GIB:.1f} GiB"
        elif time.time() - started > timeout:
            killed = f"ran past {timeout:.0f} s"
        if killed:
            proc.kill()
            break
        time.sleep(0.05)
    out, err = proc.communicate()
    for line in out.splitlines():
        if line.startswith(RESULT_TAG):
            result = json.loads(line[len(RESULT_TAG):])
            result["sampled_peak_rss"] = peak
            return result
    return {"kind": kind, "n": n, "aborted": killed or f"exit {proc.returncode}: {err.strip()[-600:]}", "sampled_peak_rss": peak}


def report(results: List[Dict[str, Any]]) -> str:
    lines = ["| points | Edge write points/s (cpu s) | optimize s | reopen s | RSS after reopen | folder | RRF p50 ms (cpu) | RRF + 5% id filter | dense |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        if r["kind"] != "store":
            continue
        if "aborted" in r:
            lines.append(f"| {r['n']:,} | aborted: {r['aborted']} | | | | | | | |")
            continue
        lines.append(
            f"| {r['n']:,} | {r['write_points_per_s']:,.0f} ({r['write_cpu_seconds']:.0f}) | {r['optimize_seconds']:.1f} | "
            f"{r['reopen_seconds']:.2f} | {scale.gib(r['rss_after_reopen'])} | {scale.mib(r['folder_bytes'])} | "
            + " | ".join(f"{r[k]['p50_ms']:.1f} ({r[k]['cpu_p50_ms']:.1f})" for k in ("rrf", "rrf_ids_filter", "dense")) + " |"
        )
    lines += ["", "| chunks | write chunks/s (excl. embedding, chunking) | per CPU s | incl. chunking | build s (cpu s) | folder | optional HNSW build, `optimize()` s (cpu s) | folder with HNSW | process peak RSS |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        if r["kind"] != "build":
            continue
        if "aborted" in r:
            lines.append(f"| {r['n']:,} docs | aborted: {r['aborted']} | | | | | | | {scale.gib(r['sampled_peak_rss'])} |")
            continue
        lines.append(
            f"| {r['chunks']:,} | {r['write_chunks_per_s']:,.0f} | {r['write_chunks_per_cpu_s']:,.0f} | {r['chunks_per_s_incl_chunking']:,.0f} | "
            f"{r['seconds']:.0f} ({r['cpu_seconds']:.0f}) | {scale.mib(r['folder_bytes'])} | {r['hnsw_seconds']:.0f} ({r['hnsw_cpu_seconds']:.0f}) | "
            f"{scale.mib(r['folder_bytes_with_hnsw'])} | {scale.gib(r['sampled_peak_rss'])} |"
        )
    lines += ["", "| chunks | reopen s | reopen + first query s | RSS after reopen | mode | p50 ms (cpu) unfiltered | p50 ms (cpu) source filter |",
              "|---|---|---|---|---|---|---|"]
    for r in results:
        if r["kind"] != "open":
            continue
        if "aborted" in r:
            lines.append(f"| {r['n']:,} docs | aborted: {r['aborted']} | | | | | |")
            continue
        for i, mode in enumerate(("hybrid", "qdrant_hybrid", "sparse", "dense")):
            u, f = r[f"{mode}_unfiltered"], r[f"{mode}_filtered"]
            head = (f"| {r['n']:,} | {r['reopen_seconds']:.2f} | {r['reopen_first_query_seconds']:.2f} | {scale.gib(r['rss_after_reopen'])} "
                    if i == 0 else "| | | | ")
            lines.append(head + f"| {mode} | {u['p50_ms']:.1f} ({u['cpu_p50_ms']:.1f}) | {f['p50_ms']:.1f} ({f['cpu_p50_ms']:.1f}) |")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="100000", help="documents (one chunk each, mostly), comma-separated")
    ap.add_argument("--mem-limit-gib", type=float, default=18.0)
    ap.add_argument("--timeout", type=float, default=3600.0)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--parts", default="store,index", help="store (Edge points alone), index (HybridIndex build and reopen)")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--n", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--workdir", type=Path, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        {"build": worker_build, "open": worker_open, "store": worker_store}[args.worker](args.n, args.workdir)
        return 0
    results: List[Dict[str, Any]] = []
    for n in scale.parse_sizes(args.sizes):
        with tempfile.TemporaryDirectory(prefix="scale_index_") as tmp:
            work = Path(tmp)
            if "store" in args.parts:
                stored = run_child("store", n, work, args.mem_limit_gib * scale.GIB, args.timeout)
                results.append(stored)
                print(json.dumps(stored), file=sys.stderr, flush=True)
            if "index" not in args.parts:
                continue
            build = run_child("build", n, work, args.mem_limit_gib * scale.GIB, args.timeout)
            results.append(build)
            print(json.dumps(build), file=sys.stderr, flush=True)
            if "aborted" not in build:
                opened = run_child("open", n, work, args.mem_limit_gib * scale.GIB, args.timeout)
                results.append(opened)
                print(json.dumps(opened), file=sys.stderr, flush=True)
    if args.json:
        args.json.write_text(json.dumps({"machine": scale.machine(), "results": results}, indent=1))
    print(report(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
